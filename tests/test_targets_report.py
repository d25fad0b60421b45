"""benchmarks/targets_report.py: the issue-22 target table from result files, checked against hand-computed
values (the bytes floor against docs/benchmarks.md's H200 numbers, the verdicts on hand-made results)."""

from __future__ import annotations

import json
import tarfile

import pytest

from tests.benchmark_scripts import load_benchmark

report = load_benchmark("targets_report")


def test_the_shape_is_throughputs_and_the_floor_is_the_documented_one():
    throughput = load_benchmark("throughput")
    assert {k: throughput.OURO_1_4B[k] for k in report.OURO_1_4B if k != "total_ut_steps"} == \
        {k: v for k, v in report.OURO_1_4B.items() if k != "total_ut_steps"}
    # docs/benchmarks.md: 4 loop passes x (2.47 GB + N x 639.5 x 192 KiB) at 4.3 TB/s = 9.78 ms (N=64), 3.23 ms (N=8)
    for N, ms in ((64, 9.78), (8, 3.23)):
        floor = report.bytes_floor_s(report.OURO_1_4B, N, 639.5, 2, 4.3e12)
        assert abs(1e3 * floor - ms) < 0.005
        assert abs(floor - 4 * (24 * 102_760_448 + N * 639.5 * 196_608) / 4.3e12) < 1e-12  # per layer 102.76 MB


def public(N: int, runs: dict[str, tuple[float, float, float, float]]) -> dict:
    """public_path.json: config -> (sync tok/s, async tok/s, sync idle share, async idle share)."""
    rows = []
    for config, (s, a, si, ai) in runs.items():
        rows += [dict(config=config, path="sync", tokens_per_s=s, gpu_idle=dict(gpu_idle_share=si)),
                 dict(config=config, path="async", tokens_per_s=a, gpu_idle=dict(gpu_idle_share=ai))]
    return dict(meta=dict(N=N), rows=rows, profiles=[])


def write(root, rel: str, data: dict) -> None:
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(json.dumps(data))


def table(capsys, *paths, extra=()) -> dict[str, tuple[str, str]]:
    assert report.main([str(p) for p in paths] + list(extra)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["| measure | value | target | met? |", "|---|---|---|---|"]
    cells = [line.strip("|").split(" | ") for line in lines[2:]]
    return {c[0].strip(): (c[1], c[3].strip()) for c in cells}


def test_verdicts_on_hand_made_results(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    good = dict(interval1=(4000, 4000, 0.05, 0.01), deferred4=(6000, 6000, 0.05, 0.015),
                deferred8=(7000, 6920, 0.05, 0.019))
    for r in (1, 2):
        write(a, f"public_n64_r{r}/public_path.json", public(64, good))
    write(a, "public_n64_r3/public_path.json",  # deferred8 async / sync = 0.96: one run below 0.97 fails it
          public(64, dict(good, deferred8=(7000, 6720, 0.05, 0.025))))
    write(a, "public_n8/public_path.json", public(8, dict(interval1=(1100, 1188, 0.1, 0.01))))  # 1188 / 45.7 = 26x
    write(a, "harness_floor/results.json", dict(meta=dict(dtype="bfloat16"), rows=[
        dict(N=64, prompt=512, output=256, config="interval1", gpu_ms_per_step=11.0),
        dict(N=8, prompt=512, output=256, config="interval1", gpu_ms_per_step=7.02)]))
    write(b, "public_n256/public_path.json", public(256, dict(interval1=(1, 1, 0.2, 0.029))))
    cold = [dict(config="interval1", process=1, ready_s=7.5, start_to_ready_s=13.0, first_over_warm=1.1),
            dict(config="interval1", process=2, ready_s=5.5, start_to_ready_s=10.0, first_over_warm=1.0)]
    write(b, "cold/cold_start.json", dict(meta={}, rows=cold))
    rollout = [dict(config="interval1", kv_allocation="lazy", tokens_per_s=3800),
               dict(config="deferred8", kv_allocation="lazy", tokens_per_s=5400),
               dict(config="deferred8", kv_allocation="reserve", tokens_per_s=9999)]  # the control: not the target's
    write(b, "rollout/rollout.json", dict(meta={}, rows=rollout))
    got = table(capsys, a, b)
    assert got["full-depth decode step / bytes floor, N=64 (decode harness)"] == ("1.12x (11.00 ms vs 9.78 ms)", "yes")
    assert got["full-depth decode step / bytes floor, N=8 (decode harness)"] == ("2.17x (7.02 ms vs 3.23 ms)", "**no**")
    assert got["full depth vs HF `generate`, N=8, through the async Engine"][1] == "yes"
    ratio = got["async Engine / SyncEngine, every config, three runs in a row"]
    assert "deferred8 0.989 / 0.989 / 0.960" in ratio[0] and "(3 runs, min 0.960)" in ratio[0] and ratio[1] == "**no**"
    idle64 = got["host time between GPU steps (GPU idle), share of the step phase, N=64, async Engine"]
    assert idle64 == ("interval1 1.0% / 1.0% / 1.0% (sync 5.0% / 5.0% / 5.0%); deferred4 1.5% / 1.5% / 1.5% "
                      "(sync 5.0% / 5.0% / 5.0%); deferred8 1.9% / 1.9% / 2.5% (sync 5.0% / 5.0% / 5.0%); worst 2.5%",
                      "**no**")
    assert got["host time between GPU steps (GPU idle), share of the step phase, N=256, async Engine"][1] == "yes"
    assert got["no regression: public path N=64 deferred B=4 / B=8 vs interval 1 (async)"] == (
        "1.50x / 1.73x, 1.50x / 1.73x, 1.50x / 1.68x", "yes")
    assert got["cold engine: ready, any mode (empty compile cache)"] == ("interval1 7.5 s (from spawn 13.0 s)", "yes")
    assert got["first 64 x 128 round / warm round (cold process)"][1] == "yes"
    assert got["second process start (warm caches): ready"][1] == "**no**"  # 5.5 s > 5 s
    assert got["rollout batch (benchmarks/rollout.py) full depth / deferred B=8 tok/s"] == ("3,800 / 5,400", "**no**")
    missing = got["p99 / p50 gap between deliveries, Poisson arrivals, top rate with interval 1 p99 TTFT < 1 s"]
    assert missing == ("not in these results", "-")
    # half the results: the other half's measures are missing, not failed; a .tgz reads like its folder
    with tarfile.open(tmp_path / "a.tgz", "w:gz") as tar:
        tar.add(a, arcname=".")
    half = table(capsys, tmp_path / "a.tgz", extra=["--hf-tok-s", "50"])
    rollout_key = "rollout batch (benchmarks/rollout.py) full depth / deferred B=8 tok/s"
    assert half[rollout_key] == ("not in these results", "-")
    assert half["full depth vs HF `generate`, N=8, through the async Engine"] == ("23.8x (1,188 vs 50 tok/s)", "**no**")


def test_the_serving_gap_is_read_at_the_top_rate_where_interval1_keeps_ttft(tmp_path, capsys):
    def row(config, rate, ttft_p99, ratio):
        return dict(config=config, rate=rate, ttft_ms=dict(p99=ttft_p99), itl_p99_over_p50=ratio)
    rows = [row("interval1", 8, 300, 1.5), row("deferred8", 8, 200, 2.5), row("interval1", 16, 900, 1.8),
            row("deferred8", 16, 500, 1.9), row("interval1", 32, 1500, 5.0), row("interval1", "inf", 100, 9.0)]
    write(tmp_path, "serving/serving.json", dict(meta={}, rows=rows, summary={}))
    got = table(capsys, tmp_path)
    key = "p99 / p50 gap between deliveries, Poisson arrivals, top rate with interval 1 p99 TTFT < 1 s (serving)"
    assert got[key] == ("rate 16/s: interval1 1.80x, deferred8 1.90x", "yes")


@pytest.mark.parametrize("flags, message", [(["--hf-tok-s", "0"], "--hf-tok-s must be > 0"),
                                             (["--bandwidth-tbps", "-1"], "--bandwidth-tbps must be > 0")])
def test_bad_flags_are_refused(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit):
        report.main([str(tmp_path)] + flags)
    assert message in capsys.readouterr().err


def test_a_missing_folder_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        report.main([str(tmp_path / "nope")])
    assert "does not exist" in capsys.readouterr().err
