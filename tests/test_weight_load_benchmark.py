"""benchmarks/weight_load.py on the CPU: both load paths give the checkpoint's tensors, and the report's
medians and ratios are those of its own runs."""

from __future__ import annotations

import json
import statistics

import pytest
import torch
from safetensors.torch import load_file

from tests.benchmark_scripts import load_benchmark

weight_load = load_benchmark("weight_load")


def test_both_paths_load_the_checkpoint(tmp_path):
    from ourobatch.testing import make_tiny_checkpoint
    ckpt = make_tiny_checkpoint(tmp_path / "ck", dtype=torch.bfloat16, num_shards=2)
    on_disk = {k: v for f in ckpt.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    for load in (weight_load.load_read, weight_load.load_mapped):
        state = load(str(ckpt), torch.float32, torch.device("cpu"))
        assert set(state) == set(on_disk)
        assert all(torch.equal(state[k], v.float()) for k, v in on_disk.items())


def test_the_report_is_its_runs_medians(tmp_path):
    result = weight_load.main(["--device", "cpu", "--tiny", "--repeats", "3", "--contention", "none,gil",
                               "--threads", "1", "--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "o")])
    saved = json.loads((tmp_path / "o" / "weight_load.json").read_text())
    assert saved["summary"] == result["summary"] and len(saved["runs"]) == 2 * 3 * 2
    for row in saved["summary"]:
        times = {p: [r["seconds"] for r in saved["runs"] if r["contention"] == row["contention"] and r["path"] == p]
                 for p in ("read", "mapped")}
        assert row["read_s"] == round(statistics.median(times["read"]), 4)
        assert (row["mapped_over_read"]
                == round(statistics.median(times["mapped"]) / statistics.median(times["read"]), 2))
    table = (tmp_path / "o" / "weight_load.md").read_text()
    assert "| none |" in table and "| gil |" in table


def test_bad_arguments_name_the_allowed_values(tmp_path, capsys):
    with pytest.raises(SystemExit):
        weight_load.main(["--device", "cpu", "--tiny", "--contention", "none,spin", "--out", str(tmp_path)])
    assert "--contention: 'spin' is not one of none, gil, forks" in capsys.readouterr().err
