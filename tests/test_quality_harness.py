"""benchmarks/quality.py on a tiny random checkpoint: the metrics are consistent with each other, with the
readout schedule and with the float64 oracle."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from ourobatch import EngineConfig, SamplingParams, SyncEngine
from engine.loader import load_model
from ourobatch.testing import make_tiny_checkpoint
from tests.benchmark_scripts import load_benchmark
from tests.oracle import expected_readout_loops, load_oracle, readout_position

ROOT = Path(__file__).resolve().parents[1]
M = 10  # generated tokens per task (no eos: every completion has exactly M)
CONFIGS = "interval1,eager4,deferred4s2,verify4"


quality = load_benchmark("quality")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("quality") / "ckpt", seed=3, eos_token_id=None)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randrange(31) for _ in range(rng.randint(3, 9))] for _ in range(6)]


@pytest.fixture(scope="module")
def run(ckpt, prompts, tmp_path_factory):
    """Targets = interval-1 greedy outputs, then main() over four configurations."""
    tmp = tmp_path_factory.mktemp("quality_run")
    with SyncEngine(EngineConfig(model=str(ckpt), mode="deferred", deep_interval=1)) as llm:
        outs = llm.generate_batch(prompts, SamplingParams(max_tokens=M, temperature=0.0))
    tasks = tmp / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"prompt_token_ids": p, "target_token_ids": o.outputs[0].token_ids}) + "\n"
                             for p, o in zip(prompts, outs)))
    out = tmp / "out"
    rc = quality.main(["--model", str(ckpt), "--tasks", str(tasks), "--out", str(out), "--max-tokens", str(M),
                       "--configs", CONFIGS])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    return out, results, {r["config"]: r for r in results["rows"]}


def test_outputs_exist(run, prompts):
    out, results, rows = run
    for name in ("results.json", "results.md", "pareto.png", "completions.jsonl"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    meta = results["meta"]
    assert meta["num_tasks"] == len(prompts) and meta["temperature"] == 0.0 and meta["dtype"] == "float32"
    assert {"date", "model", "device"} <= set(meta)
    assert list(rows) == CONFIGS.split(",")
    md = (out / "results.md").read_text()
    assert "indicative only" in md and all(f"| {name} |" in md for name in rows)


def test_interval1_is_the_reference(run):
    r = run[2]["interval1"]
    assert r["accuracy"] == 1.0 and r["agree_exact"] == 1.0 and r["agree_prefix"] == 1.0
    assert r["kl_all"] == 0.0 and r["kl_shallow"] is None
    assert r["loop_fractions"] == {"1": 0.0, "2": 0.0, "3": 0.0, "4": 1.0}
    assert r["throughput_ratio"] == 1.0 and r["acceptance_rate"] is None
    assert r["num_tokens"] == M * r["num_tasks"]


def test_eager_and_deferred_agree(run):
    eager, deferred = run[2]["eager4"], run[2]["deferred4s2"]
    for key in ("accuracy", "correct", "agree_exact", "agree_prefix", "kl_all", "kl_shallow", "loop_fractions",
                "num_tokens"):
        assert eager[key] == deferred[key], key
    assert deferred["kl_shallow"] > 0  # random weights: loop 2 is far from loop 4


def test_deferred_loop_fractions_follow_the_schedule(run):
    rows = run[2]
    expected = expected_readout_loops(M, 4, 2, 4)  # token j from loop 4 iff j == 1 or (j-1) % 4 == 0
    assert expected == [4 if j == 1 or (j - 1) % 4 == 0 else 2 for j in range(1, M + 1)]
    for name in ("eager4", "deferred4s2"):
        fr = rows[name]["loop_fractions"]
        assert fr["4"] == pytest.approx(expected.count(4) / M) and fr["2"] == pytest.approx(expected.count(2) / M)
        assert fr["1"] == 0.0 and fr["3"] == 0.0
        # kl_all spreads the shallow tokens' KL over every token
        assert rows[name]["kl_all"] == pytest.approx(rows[name]["kl_shallow"] * expected.count(2) / M)


def test_verify_is_lossless(run):
    r = run[2]["verify4"]
    assert r["agree_exact"] == 1.0 and r["agree_prefix"] == 1.0 and r["accuracy"] == 1.0
    assert r["kl_all"] == 0.0 and r["kl_shallow"] is None and r["loop_fractions"]["4"] == 1.0
    assert r["acceptance_rate"] is not None and 0.0 <= r["acceptance_rate"] <= r["acceptance_per_position"] <= 1.0


def test_confidence_intervals_contain_accuracy(run):
    for name, r in run[2].items():
        lo, hi = r["accuracy_ci95"]
        assert 0.0 <= lo <= r["accuracy"] <= hi <= 1.0, name
        assert (lo, hi) == pytest.approx(quality.wilson_interval(r["correct"], r["num_tasks"]))


def test_wilson_interval_by_hand():
    # 8 of 10, z = 1.96: center (0.8 + z^2/20) / (1 + z^2/10), half z/(1 + z^2/10) * sqrt(0.016 + z^2/400)
    z = 1.959963984540054
    denom = 1 + z * z / 10
    center, half = (0.8 + z * z / 20) / denom, z / denom * math.sqrt(0.016 + z * z / 400)
    assert quality.wilson_interval(8, 10) == pytest.approx((center - half, center + half), abs=1e-12)
    assert quality.wilson_interval(8, 10) == pytest.approx((0.4901625, 0.9433178), abs=1e-6)
    lo, hi = quality.wilson_interval(10, 10)
    assert hi == pytest.approx(1.0) and lo == pytest.approx(10 / (10 + z * z), abs=1e-12)  # n / (n + z^2)
    assert lo == pytest.approx(0.7224672, abs=1e-6)
    assert quality.wilson_interval(0, 0) == (0.0, 1.0)


def test_helpers():
    assert quality.strip_stop([5, 6, 0], "stop") == [5, 6] and quality.strip_stop([5, 6, 0], "length") == [5, 6, 0]
    assert quality.prefix_fraction([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    assert quality.prefix_fraction([1, 2], [1, 2, 3, 4]) == 0.5 and quality.prefix_fraction([], []) == 1.0
    T = 4
    cfgs = quality.parse_configs(quality.DEFAULT_CONFIGS, T, explicit=False)
    assert [c["name"] for c in cfgs][:2] == ["interval1", "eager4"] and cfgs[-1]["name"] == "verify4"
    assert len(cfgs) == 2 + 9 + 1
    assert [c["name"] for c in quality.parse_configs(quality.DEFAULT_CONFIGS, 3, explicit=False)].count(
        "deferred4s3") == 0
    assert quality.parse_configs("deferred8", T, explicit=True)[0]["name"] == "interval1"  # reference added
    with pytest.raises(ValueError):
        quality.parse_configs("deferred4s4", T, explicit=True)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-9), (torch.float32, 1e-3)])
def test_kl_matches_oracle(ckpt, prompts, dtype, tol):
    with SyncEngine(EngineConfig(model=str(ckpt), mode="deferred", deep_interval=3, shallow_loops=1,
                                 dtype="float64")) as llm:
        outs = llm.generate_batch(prompts[:3], SamplingParams(max_tokens=8, temperature=0.0))
    model = load_model(str(ckpt), dtype, "cpu")
    model.fuse_projections()
    oracle = load_oracle(ckpt)
    T = oracle.total_ut_steps
    for prompt, o in zip(prompts, outs):
        c = o.outputs[0]
        assert set(c.readout_loops) == {1, T}
        got = quality.completion_kl(model, prompt, c.token_ids, c.readout_loops, chunk=2)
        logits = oracle.forward(list(prompt) + c.token_ids[:-1]).logits  # [T, S, V] float64
        for j, (r, kl) in enumerate(zip(c.readout_loops, got), start=1):
            pos = readout_position(len(prompt), j)
            p_T = torch.softmax(logits[T - 1, pos], -1)
            want = float((p_T * (p_T.log() - torch.log_softmax(logits[r - 1, pos], -1))).sum())
            if r == T:
                assert kl == 0.0
            else:
                assert want > 1e-3 and kl == pytest.approx(want, rel=tol, abs=tol), f"token {j}"


def test_harness_on_the_shipped_model(tmp_path):
    """End to end on models/pointer-chase, where depth matters: the numbers agree with each other and with
    what the model card says about each loop."""
    model = ROOT / "models" / "pointer-chase"
    out = tmp_path / "out"
    configs = "interval1,eager4,deferred4,deferred4s3,verify4s3"
    rc = quality.main(["--model", str(model), "--tasks", str(model / "heldout_tasks.jsonl"), "--out", str(out),
                       "--limit", "60", "--configs", configs, "--no-warmup"])
    assert rc == 0
    rows = {r["config"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert list(rows) == configs.split(",")
    full, eager, s2, s3, verify = (rows[n] for n in configs.split(","))
    assert full["accuracy"] >= 0.9 and full["agree_exact"] == 1.0 and full["kl_all"] == 0.0
    for key in ("accuracy", "agree_exact", "agree_prefix", "kl_all", "kl_shallow", "loop_fractions"):
        assert eager[key] == s2[key], key
    # answer tokens 2-4 read from loop 2 (the card: loop 2 never gets an answer right)
    assert s2["accuracy"] <= full["accuracy"] - 0.10 and s2["agree_exact"] <= 1.0 - 0.10
    assert set(k for k, v in s2["loop_fractions"].items() if v > 0) == {"2", "4"}
    # loop 3 is close to loop 4 (the card: 0.974 vs 0.9985): smaller cost, smaller KL
    assert s2["accuracy"] < s3["accuracy"] <= full["accuracy"] and s3["kl_shallow"] < s2["kl_shallow"] / 10
    # verify is lossless whatever the drafts; loop-3 drafts are mostly accepted
    assert verify["agree_exact"] == 1.0 and verify["accuracy"] == full["accuracy"] and verify["kl_all"] == 0.0
    assert verify["acceptance_rate"] > 0.8 and verify["acceptance_per_position"] >= verify["acceptance_rate"]
    assert full["acceptance_per_position"] is None and s2["acceptance_per_position"] is None
