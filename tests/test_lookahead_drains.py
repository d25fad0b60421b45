"""benchmarks/lookahead_drains.py: the steps async scheduling plans ahead and its drain reasons, by workload and
pool, over the fake executor: a row per workload and pool, the reasons lookahead.py's, the eviction rule firing
where cached prompts fill the pool and not where they never need evicting; bad arguments refused naming the flag."""

from __future__ import annotations

import json

import pytest

from scheduler.lookahead import REASONS
from tests.benchmark_scripts import load_benchmark


def test_rows_add_up_and_the_eviction_rule_fires_only_where_the_pool_evicts(tmp_path, capsys):
    ld = load_benchmark("lookahead_drains")
    rows = ld.main(["--out", str(tmp_path), "--rounds", "3", "--pools", "100,4000"])
    assert [(r["workload"], r["kv_blocks"]) for r in rows] == [("groups", 100), ("groups", 4000), ("unique", 100),
                                                               ("unique", 4000)]
    for r in rows:
        assert 0 < r["planned_ahead"] < r["useful_steps"] and set(r["drains"]) <= set(REASONS), r
    by = {(r["workload"], r["kv_blocks"]): r for r in rows}
    assert by[("unique", 100)]["drains"].get("evict", 0) > 0  # 10 prompt blocks a request fill 100 within a round
    assert by[("unique", 4000)]["drains"].get("evict", 0) == 0  # 480 prompt blocks in all: nothing is evicted
    assert json.loads((tmp_path / "lookahead_drains.json").read_text()) == rows
    assert (tmp_path / "lookahead_drains.md").read_text() == capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [(["--workloads", "groups,chat"], "--workloads: each of groups, unique"),
                                               (["--rounds", "0"], "--rounds must be >= 1, got 0")])
def test_bad_arguments_are_refused_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        load_benchmark("lookahead_drains").main(argv)
    assert message in capsys.readouterr().err
