"""benchmarks/throughput.py at toy size on the CPU: config names, per-config shallow loops and the deep-call
arithmetic of the rows it reports (its timings are never asserted)."""

from __future__ import annotations

import json

import pytest

from tests.benchmark_scripts import load_benchmark

throughput = load_benchmark("throughput")


def test_parse_config():
    assert throughput.parse_config("interval1", 2) == ("deferred", 1, 2)
    assert throughput.parse_config("deferred4", 2) == ("deferred", 4, 2)
    assert throughput.parse_config("deferred8s3", 2) == ("deferred", 8, 3)
    assert throughput.parse_config("verify2s1", 3) == ("verify", 2, 1)
    for bad in ("deferred", "interval2", "fast4", "deferred4s", "eager4s2x"):
        with pytest.raises(ValueError, match="unknown config"):
            throughput.parse_config(bad, 2)


def test_interval1_is_the_same_config_in_both_harnesses():
    # One meaning everywhere (docs/recipe.md): deferred with deep_interval 1, i.e. full depth.
    quality = load_benchmark("quality")
    ref = quality.parse_configs("interval1", 4, explicit=True)[0]
    assert (ref["mode"], ref["deep_interval"], ref["shallow_loops"]) == throughput.parse_config("interval1", 2)
    assert throughput.parse_config("interval1", 2) == ("deferred", 1, 2)


def test_tiny_run(tmp_path):
    N, P, M = 3, 8, 9
    rc = throughput.main(["--device", "cpu", "--dtype", "float32", "--tiny", "--scenarios", f"{N}x{P}x{M}",
                          "--configs", "interval1,eager4,deferred4s1,deferred2s3", "--out", str(tmp_path / "out"),
                          "--workdir", str(tmp_path / "ckpt")])
    assert rc == 0
    rows = {r["config"]: r for r in json.loads((tmp_path / "out" / "results.json").read_text())["rows"]}
    assert [(r["mode"], r["deep_interval"], r["shallow_loops"]) for r in rows.values()] == [
        ("deferred", 1, 2), ("eager", 4, 2), ("deferred", 4, 1), ("deferred", 2, 3)]
    for name, r in rows.items():
        assert r["decode_tokens"] == N * (M - 1), name  # token 1 comes from the prefill
        assert r["ratio"] == pytest.approx(r["decode_tokens_per_s"] / rows["interval1"]["decode_tokens_per_s"])
    # the last token is never fed: M - 1 decode steps, a boundary every B of them, N x B rows per deep call
    for name, B in (("deferred4s1", 4), ("deferred2s3", 2)):
        assert rows[name]["deep_calls"] == (M - 1) // B and rows[name]["deep_rows"] == N * B * ((M - 1) // B)
    # interval 1 runs all T loops in one call per step, as eager does: nothing is deferred
    assert rows["eager4"]["deep_calls"] == 0 and rows["interval1"]["deep_calls"] == 0
    md = (tmp_path / "out" / "results.md").read_text()
    assert all(f"| {name} |" in md for name in rows)


def test_branch_scale_raises_acceptance_only(tmp_path):
    """--branch-scale makes consecutive loops' readouts agree (high verify acceptance) without changing the
    work: the deferred rows' deep-call arithmetic is the same."""
    rows = {}
    for scale in ("1.0", "0.001"):
        out = tmp_path / scale
        assert throughput.main(["--device", "cpu", "--dtype", "float32", "--tiny", "--scenarios", "4x8x17",
                                "--configs", "interval1,deferred4s3,verify4s3", "--branch-scale", scale,
                                "--out", str(out), "--workdir", str(tmp_path / "ckpt")]) == 0
        results = json.loads((out / "results.json").read_text())
        assert results["meta"]["branch_scale"] == float(scale)
        rows[scale] = {r["config"]: r for r in results["rows"]}
    low, high = rows["1.0"]["verify4s3"], rows["0.001"]["verify4s3"]
    assert high["acceptance_per_position"] > 0.95 > low["acceptance_per_position"]
    assert 0 <= low["acceptance_rate"] <= low["acceptance_per_position"] <= 1
    for key in ("deep_calls", "deep_rows", "decode_tokens"):
        assert rows["1.0"]["deferred4s3"][key] == rows["0.001"]["deferred4s3"][key], key
    with pytest.raises(SystemExit):
        throughput.main(["--device", "cpu", "--tiny", "--branch-scale", "0", "--out", str(tmp_path / "x")])
