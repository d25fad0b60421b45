"""benchmarks/mixed_step.py at toy size on the CPU: every timed step ran what it says (N decode rows, one
chunk of k tokens at the right start), every number of the JSON is recomputed here from the samples
(numpy's medians, percentiles and least squares, not the script's), and the summary line follows its
definition. Timings are never asserted, only their consistency."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engine.loader import load_model
from tests.benchmark_scripts import load_benchmark

mixed = load_benchmark("mixed_step")
report = load_benchmark("mixed_step_report")

NS, KS, H, REPS, BETWEEN = (2, 3), (0, 4, 16), 8, 2, 1
ARGS = ["--device", "cpu", "--dtype", "float32", "--tiny", "--configs", "interval1,deferred4", "--ns",
        ",".join(map(str, NS)), "--ks", ",".join(map(str, KS)), "--history", str(H), "--block-size", "4",
        "--reps", str(REPS), "--between", str(BETWEEN), "--decode-prompt", "6", "--profile-k", "4"]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("mixed")
    assert mixed.main([*ARGS, "--workdir", str(tmp_path_factory.mktemp("ckpt")), "--out", str(out)]) == 0
    return json.loads((out / "mixed_step.json").read_text()), (out / "mixed_step.md").read_text()


def test_every_timed_step_ran_its_chunk_beside_n_decode_rows(result):
    data, _ = result
    samples = data["samples"]
    for config in ("interval1", "deferred4"):
        for N in NS:
            mine = [s for s in samples if s["config"] == config and s["N"] == N]
            decode = [s for s in mine if s["kind"] == "decode"]
            assert len(decode) == 3 * REPS + BETWEEN * REPS * 2 * (len(KS) - 1)
            assert all(s["decode_rows"] == N and s["prefill_tokens"] == 0 and s["starts"] == [] for s in decode)
            for kind, start in (("fresh", 0), ("history", H)):
                for k in KS[1:]:
                    group = [s for s in mine if s["kind"] == kind and s["k"] == k]
                    assert len(group) == REPS
                    assert all((s["decode_rows"], s["prefill_tokens"], s["starts"]) == (N, k, [start]) for s in group)
            for s in mine:
                parts = s["schedule_ms"] + s["launch_ms"] + s["result_ms"] + s["update_ms"]
                assert s["step_ms"] == pytest.approx(parts, rel=1e-6)
                assert s["gpu_ms"] is None and s["allocator"] is None  # CUDA only


def test_rows_and_summary_follow_from_the_samples(result):
    data, md = result
    samples, rows = data["samples"], data["rows"]
    for summary in data["summary"]:
        config, N, kind = summary["config"], summary["N"], summary["kind"]
        mine = [s for s in samples if s["config"] == config and s["N"] == N]
        decode = [s["step_ms"] for s in mine if s["kind"] == "decode"]
        base = {deep: float(np.median([s["step_ms"] for s in mine if s["kind"] == "decode" and s["deep"] == deep]
                                      or decode)) for deep in (False, True)}
        assert summary["decode_ms"] == pytest.approx(float(np.median(decode)))
        ratios, points = {}, []
        for k in KS[1:]:
            group = [s for s in mine if s["kind"] == kind and s["k"] == k]
            row = next(r for r in rows if (r["config"], r["N"], r["kind"], r["k"]) == (config, N, kind, k))
            ratios[k] = float(np.median([s["step_ms"] / base[s["deep"]] for s in group]))
            assert row["ratio"] == pytest.approx(ratios[k])
            assert row["step_ms"]["p50"] == pytest.approx(float(np.median([s["step_ms"] for s in group])))
            assert row["step_ms"]["p99"] == pytest.approx(float(np.percentile([s["step_ms"] for s in group], 99)))
            points += [(k, s["step_ms"] - base[s["deep"]]) for s in group]
        within = [k for k in KS[1:] if ratios[k] <= 1.5]
        assert summary["largest_k"] == (max(within) if within else None)
        slope, fixed = np.polyfit([k for k, _ in points], [e for _, e in points], 1)
        assert summary["fixed_ms"] == pytest.approx(fixed, abs=1e-6)
        assert summary["us_per_token"] == pytest.approx(1e3 * slope, abs=1e-6)
        assert report.summary_line(summary) in md and "largest k whose mixed step stays <= 1.5x" in md


def test_profile_traces_one_step_of_each_kind(result):
    data, md = result
    profile = data["profile"]
    assert (profile["config"], profile["N"], profile["k"]) == ("interval1", max(NS), 4)
    for name, start in (("decode", None), ("fresh", 0), ("history", H)):
        p = profile[name]
        assert p["sample"]["kind"] == name and p["sample"]["starts"] == ([] if start is None else [start])
        assert p["top_cpu"] and p["host_ms"] > 0 and p["device_activities"] == 0  # CPU: no device trace
        assert any("aten::" in c["name"] for c in p["top_cpu"])
    # the history step's own prefill (the prefix) runs before the traced step: only the chunk is traced
    assert profile["history"]["sample"]["prefill_tokens"] == 4
    assert data["syncs"] is None and "Profile (interval1, N = 3" in md


def test_gemm_flops_count_every_weight_of_the_loops(tmp_path):
    from ourobatch.testing import make_tiny_checkpoint

    model = load_model(make_tiny_checkpoint(tmp_path / "m", num_key_value_heads=1), torch.float32)
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    weights = sum(p.numel() for n, p in model.named_parameters() if any(f".{w}." in n for w in names))
    assert report.gemm_flops_per_token(model.config) == 2 * weights * model.config.total_ut_steps


@pytest.mark.parametrize("extra,message", [
    (["--ks", "0,x"], "--ks takes comma-separated integers"), (["--ns", "0"], "--ns takes distinct integers >= 1"),
    (["--ks", "4,4"], "--ks takes distinct"), (["--history", "6", "--block-size", "4"], "multiple of --block-size"),
    (["--profile-k", "99", "--ks", "0,8"], "--profile-k must be <= the largest of --ks"),
    (["--configs", "interval1,nope"], "unknown config 'nope'"), (["--reps", "0"], "--reps must be >= 1"),
    (["--threshold", "1"], "--threshold must be > 1")])
def test_bad_arguments_name_the_flag(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exc:
        mixed.main(["--out", str(tmp_path), *extra])
    assert exc.value.code == 2 and message in capsys.readouterr().err
