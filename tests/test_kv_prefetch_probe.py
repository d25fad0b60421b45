"""benchmarks/kv_prefetch_probe.py's host side: which settings gpu_suite.sh's kv_prefetch mode hands the decode
harness (`best`: only ones that equalled the kernels way's readout and beat it), and its table (no GPU needed)."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import load_benchmark

probe = load_benchmark("kv_prefetch_probe")


def result(ways: dict, unequal=()) -> dict:
    checks = {name: {"finite": True, ("equal_to_attention" if name.startswith("attention") else "equal_to_kernels"):
                     name not in unequal} for name in ways}
    return {"floor_ms": 2.0, "rows": 64, "context": 640, "layers": 24, "ways": ways, "checks": checks}


def test_best_takes_the_fastest_settings_that_equal_and_beat_the_kernels():
    ways = {"kernels": [3.0, 2.9], "attention": [1.0, 1.0], "attention_pf2": [0.5, 0.5], "2:norm": [2.8, 2.7],
            "3:norm": [2.6, 2.75], "3:qkv": [2.65, 2.7], "4:norm": [2.5, 2.5], "1:qkv": [2.95, 2.91]}
    assert probe.best(result(ways, unequal={"4:norm"}), 2) == ["3:norm", "3:qkv"]
    assert probe.best(result(ways, unequal={"4:norm"}), 9) == ["3:norm", "3:qkv", "2:norm"]  # 1:qkv: no faster
    assert probe.best(result({"kernels": [3.0], "2:norm": [3.1]}), 2) == []


def test_the_table_lists_the_fastest_first_with_the_gain_a_layer():
    text = probe.table(result({"kernels": [3.0, 2.9], "3:norm": [2.78, 2.8], "attention": [1.9, 1.9]}))
    rows = [line.split(" | ")[0].lstrip("| ") for line in text.splitlines()[2:]]
    assert rows == ["attention", "3:norm", "kernels"]
    assert "| 2.780 / 2.800 | 1.390 | -5.00 | True |" in text  # (2.78 - 2.9) ms over 24 layers


def test_the_ways_take_each_suffix_and_the_line_attention_only_when_asked():
    ways = probe.Probe.ways(object(), [3], ["qkv", "norm"], ("", ":line"))  # the lambdas are not called here
    assert sorted(ways) == sorted(["kernels", "attention", "attention_pf3", "attention_pf3:line", "3:qkv",
                                   "3:qkv:line", "3:norm", "3:norm:line"])
    assert "attention_pf3:line" not in probe.Probe.ways(object(), [3], ["qkv"])


def test_pages_zero_leaves_only_the_kernels_and_the_attention_alone():
    assert probe.parse_pages("0") == [] and probe.parse_pages("1,3") == [1, 3]
    for bad in ("", "0,2", "-1", "x", "2,,3"):
        assert probe.parse_pages(bad) is None, bad
    assert sorted(probe.Probe.ways(object(), probe.parse_pages("0"), ["qkv"])) == ["attention", "kernels"]


@pytest.mark.parametrize("flags,message", [
    (["--suffixes", ",:fast"], "--suffixes: comma-separated tails made of :normal, :end and :line"),
    (["--pages", "0,2"], "--pages: 0, or a comma list of page counts of at least 1; got '0,2'"),
    (["--persist-mb", "-1"], "--persist-mb: 0 (none) or more MB; got -1")])
def test_bad_flags_are_refused_before_a_gpu_is_needed(tmp_path, flags, message):
    import subprocess
    import sys

    from tests.benchmark_scripts import BENCHMARKS

    run = subprocess.run([sys.executable, str(BENCHMARKS / "kv_prefetch_probe.py"), "--out", str(tmp_path), *flags],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and message in run.stderr
