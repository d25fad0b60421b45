"""benchmarks/gpu_suite.sh in its CPU smoke mode (SUITE_SMOKE=1: no install, no GPU, toy sizes): every mode
leaves only summary.md and results.tgz under $OUT (the device returns a handful of files), the tarball holds
every result and log, and the targets mode's stages all run and feed benchmarks/targets_report.py."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests.benchmark_scripts import load_benchmark

SUITE = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_suite.sh"
pytestmark = pytest.mark.timeout(900)


def suite(tmp_path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    environ = dict(os.environ, SUITE_SMOKE="1", OUT=str(out), SUITE_WORKDIR=str(tmp_path / "ckpt"), **env)
    run = subprocess.run(["bash", str(SUITE), *args], capture_output=True, text=True, env=environ,
                         cwd=SUITE.parents[1], timeout=850)
    return run, out


def members(out: Path) -> set[str]:
    assert sorted(p.name for p in out.iterdir()) == ["results.tgz", "summary.md"]
    with tarfile.open(out / "results.tgz") as tar:
        return {m.name.removeprefix("./") for m in tar.getmembers() if m.isfile()}


def test_a_mode_packs_everything_into_one_tarball_and_a_summary(tmp_path):
    run, out = suite(tmp_path, "cold", "--device", "cpu", "--dtype", "float32", "--tiny", "-N", "2", "-P", "20", "-M",
                     "3", "--configs", "interval1", "--rounds", "2", "--workdir", str(tmp_path / "ckpt"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert members(out) == {"gpu.txt", "cold.log", "cold/cold_start.json", "cold/cold_start.md"}
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# gpu_suite.sh cold: exit 0") and "## cold/cold_start.md" in summary
    assert "| interval1 | 2 |" in summary


def test_the_load_mode_compares_both_paths(tmp_path):
    run, out = suite(tmp_path, "load", "--device", "cpu", "--tiny", "--repeats", "1", "--contention", "none,forks",
                     "--workdir", str(tmp_path / "ckpt"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert members(out) == {"gpu.txt", "load.log", "load/weight_load.json", "load/weight_load.md"}
    summary = (out / "summary.md").read_text()
    assert "| none |" in summary and "| forks |" in summary


def test_a_failed_run_and_skipped_stages_are_packed_too(tmp_path):
    run, out = suite(tmp_path, "cold", "--device", "cpu", "--configs", "nosuchmode")  # cold_start.py refuses it
    assert members(out) == {"gpu.txt", "cold.log"}
    assert "unknown config 'nosuchmode'" in (out / "summary.md").read_text()  # no table: the log's last lines
    run, out = suite(tmp_path, "targets_b", TARGETS_BUDGET_S="30")  # too little time: every stage skipped
    assert run.returncode == 0 and members(out) >= {"stages.md", "gpu.txt"}
    summary = (out / "summary.md").read_text()
    assert summary.count("skipped") == 4 and "| cold engine: ready, any mode (empty compile cache) | not in" in summary


def test_the_targets_mode_runs_every_stage_and_reports_the_table(tmp_path):
    run, out = suite(tmp_path, "targets", TARGETS_BUDGET_S="1500")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    files = members(out)
    stages = ["public_n64_r1", "public_n64_r2", "public_n64_r3", "public_n8", "harness_floor", "cold", "rollout",
              "public_n256", "itl_serve"]
    assert {f"{s}.log" for s in stages} <= files and "model_config.json" in files
    assert {"public_n64_r1/public_path.json", "public_n8/public_path.json", "public_n256/public_path.json",
            "harness_floor/results.json", "cold/cold_start.json", "rollout/rollout.json",
            "itl_serve/serving.json"} <= files
    summary = (out / "summary.md").read_text()
    for s in stages:
        assert f"| {s} | 0 |" in summary  # each stage exited 0
    # the summary's target table is targets_report.py's on the tarball (every measure found)
    unpacked = tmp_path / "unpacked"
    with tarfile.open(out / "results.tgz") as tar:
        tar.extractall(unpacked, filter="data")
    report = load_benchmark("targets_report")
    table = report.report(report.load([unpacked]), argparse.Namespace(hf_tok_s=45.7, bandwidth_tbps=4.3))
    assert table in summary
    rows = table.splitlines()[2:]
    assert len(rows) == 12 and not any("not in these results" in r for r in rows)
    runs = [json.loads((unpacked / f"public_n64_r{r}" / "public_path.json").read_text()) for r in (1, 2, 3)]
    assert [len(x["profiles"]) for x in runs] == [3, 0, 0]  # the profile in the first run only
    assert all(row["gpu_idle"]["steps"] > 0 for x in runs for row in x["rows"])


def test_the_gpu_tests_split_into_parts_that_cover_every_file_once(tmp_path):
    # GPU_TESTS_PART=i/n: the suite outgrew one 600 s device call; the parts must cover tests/gpu exactly once
    files = sorted(p.name for p in (SUITE.parents[1] / "tests" / "gpu").glob("test_*.py"))
    seen: list[str] = []
    for part in (1, 2):
        run, out = suite(tmp_path / str(part), "tests", GPU_TESTS_PART=f"{part}/2")
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        with tarfile.open(out / "results.tgz") as tar:
            listed = tar.extractfile("./gpu.txt").read().decode().split("GPU_TESTS_PART")[1].split()[1:]
        assert listed and all(name.startswith("tests/gpu/test_") for name in listed)
        seen += [Path(name).name for name in listed]
    assert sorted(seen) == files
