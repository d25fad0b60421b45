"""examples/grpo_loop.py: two GRPO iterations on the shipped pointer-chase model, on the CPU, continuous
(the default, through ourobatch.rollout.Collector) and synchronous (--sync, the control). In both, the
learner's replay agrees with the engine's log-probs on every token drawn under the learner's current
weights (float32 rounding), the step moves the policy by far more than that, and the next iteration's
current tokens agree again: the update reached the engine. Continuous batches may hold tokens drawn one
update back (max_staleness=1), never more; the synchronous loop has none."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NUM = r"([\d.e+-]+|-)"  # a number, or "-": no token of that kind in the batch
LINE = re.compile(rf"iter (\d+): reward=([\d.]+) stale_share=([\d.]+) max\|ratio-1\| current={NUM} mixed={NUM} "
                  rf"stale={NUM} policy_change=([\d.e+-]+) rollout_versions=\[([\d, ]*)\] version=(\d+)")
COLLECTOR = re.compile(r"collector: batches=(\d+) groups_stale=\d+ mixed_version_samples=\d+ samples_restarted=\d+ "
                       r"staleness_histogram=(\{.*\})")


def run_grpo(*args: str) -> list[str]:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "grpo_loop.py"), "--iterations", "2", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip().splitlines()


def check_iterations(lines: list[str], max_staleness: int) -> None:
    rows = [LINE.fullmatch(line) for line in lines]
    assert len(rows) == 2 and all(rows), lines
    for k, m in enumerate(rows, start=1):
        it, reward, stale_share, current, mixed, stale, moved, versions, version = m.groups()
        assert (int(it), int(version)) == (k, k)
        assert 0 <= float(reward) <= 1 and 0 <= float(stale_share) <= 1
        rollout_versions = [int(v) for v in versions.split(",")]
        # every token was drawn at most max_staleness updates before the learner's version (k - 1)
        assert all(k - 1 - max_staleness <= v <= k - 1 for v in rollout_versions), versions
        # the engine serves exactly the learner's weights: rounding only, wherever tokens are current
        assert current == "-" or float(current) < 1e-4, m.group(0)
        assert (stale == "-") == (float(stale_share) == 0), m.group(0)
        if k == 1:  # nothing is stale before the first update, and the first step changes the policy
            assert current != "-" and (mixed, stale) == ("-", "-")
            assert float(moved) > 1e-2


def test_grpo_loop_continuous():
    lines = run_grpo()  # Collector, max_staleness=1, on_update="continue"
    check_iterations(lines[:2], max_staleness=1)
    m = COLLECTOR.fullmatch(lines[2])
    assert m and m.group(1) == "2", lines
    assert set(ast.literal_eval(m.group(2))) <= {0, 1}  # consumed tokens by staleness: within the bound


def test_grpo_loop_sync():
    lines = run_grpo("--sync")
    check_iterations(lines, max_staleness=0)
    assert all("stale_share=0.000 " in line and " stale=- " in line for line in lines), lines
