"""benchmarks/prefetch_probe.py's CPU side: its refusals and its table (the kernels: test_prefetch_kernels_emulated.py;
the timings need a GPU)."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import load_benchmark


def test_the_probe_refuses_unknown_chains(capsys):
    probe = load_benchmark("prefetch_probe")
    for ops in ("gate,up", "", "o"):
        with pytest.raises(SystemExit):
            probe.main(["--out", "/nonexistent", "--ops", ops])
        assert "--ops must be a comma list of gate, qkv, down" in capsys.readouterr().err


def test_the_harness_refuses_a_ring_it_cannot_run_and_an_unknown_way(capsys):
    probe = load_benchmark("prefetch_probe")
    for ring in ("8", "8,1", "8,x", "4,4,4"):
        with pytest.raises(SystemExit):
            probe.main(["--out", "/nonexistent", "--harness", "down", "--ring", ring])
        assert "--ring must be two counts >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        probe.main(["--out", "/nonexistent", "--harness", "qkv"])
    assert "invalid choice: 'qkv'" in capsys.readouterr().err


def test_the_table_has_a_row_per_way_and_marks_wrong_outputs():
    probe = load_benchmark("prefetch_probe")
    rows = [{"op": "gate", "way": "triton", "ring": None, "err": 0.0, "ok": True, "chain_us": 27.7, "alone_us": 20.1},
            {"op": "qkv", "way": "prefetch", "ring": [16, 2], "err": 0.3, "ok": False, "chain_us": 21.5,
             "alone_us": 12.0}]
    lines = probe.markdown(rows).splitlines()
    assert len(lines) == 4 and {line.count("|") for line in lines} == {7}
    assert lines[2] == "| o -> add + norm -> gate_up | triton | - | 27.70 | 20.10 | 0.0e+00 |"
    assert lines[3].startswith("| down -> add + norm -> qkv | prefetch | 16, 2 | 21.50 WRONG | 12.00 |")
