"""benchmarks/pareto.py: quality rows meet the throughput row of the same (mode, B, s), and only that one."""

from __future__ import annotations

import json

import pytest

from tests.benchmark_scripts import load_benchmark

pareto = load_benchmark("pareto")


def q(config, mode, B, s, acc):
    return dict(config=config, mode=mode, deep_interval=B, shallow_loops=s, accuracy=acc,
                accuracy_ci95=[max(0.0, acc - 0.1), min(1.0, acc + 0.1)], agree_exact=acc, kl_shallow=None)


def t(config, mode, B, s, ratio, N=64):
    return dict(config=config, mode=mode, deep_interval=B, shallow_loops=s, ratio=ratio, N=N, prompt=512, output=512)


QUALITY = [q("interval1", "deferred", 1, 2, 1.0), q("deferred4s3", "deferred", 4, 3, 0.9),
           q("deferred4s2", "deferred", 4, 2, 0.1), q("eager4", "eager", 4, 2, 0.1), q("verify4", "verify", 4, 2, 1.0)]
THROUGHPUT = [t("interval1", "eager", 1, 2, 1.0), t("deferred4", "deferred", 4, 2, 1.55),
              t("deferred4s3", "deferred", 4, 3, 1.2), t("eager4", "eager", 4, 2, 1.02),
              t("deferred4", "deferred", 4, 2, 1.4, N=256)]


def test_join_matches_mode_interval_and_shallow_loops():
    rows = {r["config"]: r for r in pareto.join(QUALITY, THROUGHPUT, (64, 512, 512))}
    assert rows["interval1"]["speedup"] == 1.0  # full depth: eager B=1 there, deferred B=1 here
    assert rows["deferred4s3"]["speedup"] == 1.2 and rows["deferred4s2"]["speedup"] == 1.55
    assert rows["eager4"]["speedup"] == 1.02
    assert rows["verify4"]["speedup"] is None and rows["verify4"]["scenario"] is None
    assert rows["deferred4s2"]["scenario"] == "64x512x512"
    assert pareto.join(QUALITY, THROUGHPUT, (256, 512, 512))[2]["speedup"] == 1.4


def test_two_scenarios_need_a_choice():
    with pytest.raises(ValueError, match="--scenario"):
        pareto.join(QUALITY, THROUGHPUT, None)


def test_main_writes_plot_and_table(tmp_path):
    meta_q = dict(model="m/pointer-chase", num_tasks=10, device="cpu", dtype="float32", date="today")
    meta_t = dict(device_name="GPU", dtype="bfloat16", date="today")
    (tmp_path / "q.json").write_text(json.dumps(dict(meta=meta_q, rows=QUALITY)))
    (tmp_path / "t.json").write_text(json.dumps(dict(meta=meta_t, rows=THROUGHPUT)))
    rc = pareto.main(["--quality", str(tmp_path / "q.json"), "--throughput", str(tmp_path / "t.json"),
                      "--scenario", "64x512x512", "--out", str(tmp_path / "p.png"),
                      "--markdown", str(tmp_path / "p.md")])
    assert rc == 0 and (tmp_path / "p.png").stat().st_size > 0
    md = (tmp_path / "p.md").read_text()
    assert "| deferred4s3 | deferred | 4 | 3 | 0.900 [0.800, 1.000] | 0.900 | - | 1.20 |" in md
    assert "| verify4 | verify | 4 | 2 | 1.000 [0.900, 1.000] | 1.000 | - | not measured |" in md
    with pytest.raises(SystemExit):
        pareto.main(["--quality", str(tmp_path / "q.json"), "--throughput", str(tmp_path / "t.json"),
                     "--scenario", "64x512", "--out", str(tmp_path / "x.png")])
