"""benchmarks/rl_pipeline.py at toy size on the CPU: every run is there, with whole batches, the drawn lengths,
the staleness bound and no mixed versions where none may be (its timings are never asserted)."""

from __future__ import annotations

import argparse
import json

from tests.benchmark_scripts import load_benchmark

rl_pipeline = load_benchmark("rl_pipeline")

R, N, K = 2, 2, 5


def test_tiny_run_has_every_run_with_whole_batches_and_the_staleness_bound(tmp_path):
    out = tmp_path / "out"
    rc = rl_pipeline.main(["--tiny", "--device", "cpu", "--prompts", str(R), "--n", str(N), "--batches", str(K),
                           "--prompt-len", "8", "--max-tokens", "8", "--median", "4", "--train-s", "0.02",
                           "--configs", "interval1,deferred8", "--out", str(out), "--workdir", str(tmp_path / "ckpt")])
    assert rc == 0
    rows = json.loads((out / "rl_pipeline.json").read_text())["rows"]
    runs = [(r["config"], r["loop"], r["eta"], r["policy"]) for r in rows]
    expected = [(c, "sync", None, None) for c in ("interval1", "deferred8")] + [
        (c, "collector", e, p) for c in ("interval1", "deferred8") for e in (0, 1, 2)
        for p in ("continue", "recompute", "abort")]
    assert sorted(runs, key=str) == sorted(expected, key=str)

    args = argparse.Namespace(batches=K, prompts=R, n=N, prompt_len=8, sigma=0.9, max_tokens=8)
    drawn = sum(sum(t["targets"]) for t in rl_pipeline.make_tasks(args, vocab=97, seed=0, median=4))
    for r in rows:
        run = runs[rows.index(r)]
        assert r["batches"] == len(r["batch_records"]) >= K, run
        for b in r["batch_records"]:
            assert b["group_sizes"] == [N] * R and b["tokens"] > 0, run  # complete groups only
            assert b["t_consumed"] <= b["t_trained"], run
        assert r["tokens"] == drawn, run  # every sample ended at its drawn length, in every loop
        assert r["tokens_per_s"] > 0 and r["steady_tokens_per_s"] > 0 and r["trace"], run
        generated = [p[4] for p in r["trace"]]  # tokens generated so far, sampled over the run
        assert generated == sorted(generated) and generated[-1] <= r["tokens_generated"], run
        assert r["steady_generated_tokens_per_s"] >= 0, run
        hist = {int(k): v for k, v in r["staleness_histogram"].items()}
        assert sum(hist.values()) == r["tokens"], run
        if r["loop"] == "sync" or r["eta"] == 0:
            assert set(hist) == {0} and r["mixed_version_samples"] == 0, run
        else:
            assert max(hist) <= r["eta"], run  # the bound, as the collector counts it
            # ... and as the benchmark counts it from the samples' own weight_versions
            assert {int(k): v for k, v in r["staleness_histogram_check"].items()} == hist, run
            assert r["mixed_version_samples_check"] == r["mixed_version_samples"], run
        if r["loop"] == "collector" and r["policy"] == "abort":
            assert r["mixed_version_samples"] == 0, run  # restarted from scratch: one version per sample
    md = (out / "rl_pipeline.md").read_text()
    assert "| interval1 | sync |" in md and "| deferred8 | collector | 1 | continue |" in md
    assert (out / "rl_pipeline_running.png").stat().st_size > 0
