"""benchmarks/attention_sweep.py: the robust pick and the LAUNCH_TABLE rows it suggests (CPU; its timings are
never asserted). The --smoke run needs Triton (TRITON_INTERPRET=1) and is skipped without it."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from engine.attention_dispatch import INF, LAUNCH_TABLE, LaunchConfig, choose_config
from tests.benchmark_scripts import BENCHMARKS, load_benchmark

sweep = load_benchmark("attention_sweep")


def shape(times: dict[str, float]) -> dict:
    cands = {c: dict(us=t, tbps=1.0, ok=True) for c, t in times.items()}
    best = min(times, key=times.get)
    return dict(candidates=cands, best=dict(config=best, us=times[best]))


def test_the_pick_is_robust_across_shapes_not_the_best_of_one():
    # A wins one shape by 10% and loses the other by 2x; B is within 5% of the best everywhere
    shapes = [shape({"n64/w4/s2/k4": 90, "n32/w4/s2/k8": 100, "n64/w8/s2/k1": 300}),
              shape({"n64/w4/s2/k4": 200, "n32/w4/s2/k8": 105, "n64/w8/s2/k1": 100})]
    best, score = sweep.geomean_pick(shapes)
    assert best == "n32/w4/s2/k8"
    assert score == pytest.approx(math.sqrt(100 / 90 * 105 / 100))
    shapes[1]["candidates"]["n32/w4/s2/k8"]["ok"] = False  # a wrong result never wins
    assert sweep.geomean_pick(shapes)[0] != "n32/w4/s2/k8"


def test_suggested_rows_paste_into_the_table_and_dispatch_each_n_to_its_pick():
    picks = {8: "n64/w8/s3/k4", 16: "n64/w4/s3/k2", 64: "n128/w4/s2/k1", 256: "n64/w4/s3/k1"}
    rows = sweep.suggest_table(picks, 132, 16)
    code = sweep.format_table(rows)
    namespace = dict(INF=INF, LaunchConfig=LaunchConfig)
    exec(code, namespace)  # what a person pastes into engine/attention_dispatch.py
    table = namespace["LAUNCH_TABLE"]
    assert table == tuple(rows)
    for n, name in picks.items():
        assert choose_config(n, 16, 1, 128, 132, table) == sweep.parse(name)
    # fewer requests than measured: at least the smallest N's splits, its kernel config
    small = choose_config(1, 16, 1, 128, 132, table)
    assert (small.block_n, small.num_warps, small.num_stages) == (64, 8, 3) and small.splits >= 4
    # big tiles keep the current rows
    assert choose_config(8, 16, 64, 128, 132, table) == choose_config(8, 16, 64, 128, 132, LAUNCH_TABLE)


def test_split_counts_stay_within_16_programs_per_sm():
    assert sweep.meaningful_splits(8, 132) == [1, 2, 4, 8, 16]
    assert sweep.meaningful_splits(64, 132) == [1, 2]
    assert sweep.meaningful_splits(256, 132) == [1]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter)")
def test_smoke_run_writes_json_and_markdown(tmp_path):
    from tests.interpreter import NUMPY_24_SHIM, script_source  # Triton 3.6's interpreter with numpy >= 2.4

    env = dict(os.environ, TRITON_INTERPRET="1")
    run = script_source(BENCHMARKS / "attention_sweep.py", "--smoke", "--out", str(tmp_path))
    subprocess.run([sys.executable, "-W", "ignore", "-c", NUMPY_24_SHIM + run], check=True, env=env,
                   capture_output=True, timeout=240)
    res = json.loads((tmp_path / "sweep.json").read_text())
    assert {(s["n"], s["ctx"], s["rows"]) for s in res["shapes"]} == {(2, 21, 1), (2, 21, 2)}
    assert all(s["candidates"]["default"]["ok"] and s["best"]["config"] for s in res["shapes"])
    assert "LAUNCH_TABLE" in (tmp_path / "sweep.md").read_text()
