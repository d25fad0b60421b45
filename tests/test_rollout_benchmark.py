"""benchmarks/rollout.py at toy size on the CPU: the workload it builds and the counts it reports (its timings
are never asserted)."""

from __future__ import annotations

import json
import random

from tests.benchmark_scripts import load_benchmark

rollout = load_benchmark("rollout")


def test_lengths_are_seeded_capped_lognormal():
    a = rollout.draw_lengths(random.Random(3), 2000, median=40, sigma=0.9, cap=100)
    b = rollout.draw_lengths(random.Random(3), 2000, median=40, sigma=0.9, cap=100)
    assert a == b and min(a) >= 1 and max(a) == 100
    assert 35 <= sorted(a)[1000] <= 45  # the median


def test_tiny_run_counts_tokens_and_shared_prefills(tmp_path):
    R, n, P = 3, 2, 18
    rc = rollout.main(["--device", "cpu", "--dtype", "float32", "--tiny", "--prompts", str(R), "--n", str(n),
                       "--prompt-len", str(P), "--max-tokens", "20", "--median", "6", "--block-size", "4",
                       "--num-kv-blocks", "40", "--configs", "interval1,deferred4", "--allocations", "lazy,reserve",
                       "--sample-interval", "0.001",  # a toy round can end within the default 50 ms
                       "--out", str(tmp_path / "out"), "--workdir", str(tmp_path / "ckpt")])
    assert rc == 0
    data = json.loads((tmp_path / "out" / "rollout.json").read_text())
    rows = data["rows"]
    assert [(r["config"], r["kv_allocation"]) for r in rows] == [
        ("interval1", "lazy"), ("deferred4", "lazy"), ("interval1", "reserve"), ("deferred4", "reserve")]
    args = type("A", (), dict(prompts=R, n=n, prompt_len=P, sigma=0.9, max_tokens=20))
    _, lengths = rollout.workload(args, vocab=97, seed=0, median=6)
    for r in rows:
        assert r["tokens"] == sum(map(sum, lengths))  # every sample stopped exactly at its drawn length
        if r["preemptions"] == 0:
            assert r["prefill_tokens_requested"] == R * n * P
        # the n samples of a prompt prefill its 4 full blocks once: each sample computes only its last block
        assert r["prefill_tokens_computed"] <= R * (P + (n - 1) * (P - 16)) + r["recomputed_tokens"]
        assert 1 <= r["peak_running"] <= R * n and len(r["trace"]) > 0
    md = (tmp_path / "out" / "rollout.md").read_text()
    assert "| interval1 | lazy |" in md and "| deferred4 | reserve |" in md
    assert (tmp_path / "out" / "rollout_kv.png").stat().st_size > 0
