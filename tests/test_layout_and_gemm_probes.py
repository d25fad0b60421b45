"""The host side of benchmarks/kv_layout_probe.py (the layouts' table: each layout and pool's time, HND over NHD per
pool, wrong outputs marked) and of benchmarks/gemm_scaling_probe.py (its table, the K sweep's line), on hand-made
rows (no GPU); of benchmarks/weight_layout_probe.py its packing and table, and its kernel on every layout in Triton's
interpreter (where Triton is installed) against the math in float64; benchmarks/splitk_pair_probe.py's split-K
kernel likewise, twice on one set of counters."""

from __future__ import annotations

import json

import pytest
import torch

from tests.benchmark_scripts import load_benchmark
from tests.interpreter import run_interpreted

layout = load_benchmark("kv_layout_probe")
scaling = load_benchmark("gemm_scaling_probe")
weight_layout = load_benchmark("weight_layout_probe")


def row(layout_name: str, pool: str, us: float, launch: str = "table", ok: bool = True) -> dict:
    return {"n": 64, "ctx": 640, "layout": layout_name, "pool": pool, "launch": launch, "us": us, "tbps": 335 / us,
            "ok": ok}


def test_the_layout_table_gives_hnd_over_nhd_in_each_pool():
    rows = [row("nhd", "compact", 80.0), row("nhd", "spread", 82.0), row("hnd", "compact", 88.0),
            row("hnd", "spread", 82.0 * 0.95, ok=False), row("nhd", "compact", 50.0, launch="n16/w1/s4/k1")]
    lines = layout.markdown(rows).splitlines()
    assert lines[0].startswith("| N | L | launch | nhd compact us (TB/s) | nhd spread us (TB/s) | hnd compact")
    table_row = next(line for line in lines if "| table |" in line)
    assert table_row.endswith("| 1.100 / 0.950 |")
    assert "77.9 (4.30) WRONG" in table_row  # hnd spread's output was off: its time is marked
    n16 = next(line for line in lines if "| n16/w1/s4/k1 |" in line)
    assert "| 50.0 (6.70) | - | - | - | - |" in n16  # one cell measured: no ratio


def test_the_scaling_table_lists_each_op_and_program_count():
    rows = [{"op": "gate", "programs": 88, "per_sm": 88 / 132, "us": 20.0, "weight_mb": 46.1, "tbps": 2.305},
            {"op": "qkv", "programs": 192, "per_sm": 192 / 132, "us": 12.5, "weight_mb": 25.2, "tbps": 2.016}]
    lines = scaling.markdown(rows).splitlines()
    assert lines[2] == "| gate | 88 | 0.67 | 20.00 | 46.1 | 2.31 |"
    assert lines[3] == "| qkv | 192 | 1.45 | 12.50 | 25.2 | 2.02 |"


def test_the_k_sweep_fit_recovers_a_launchs_fixed_cost_and_rate():
    """us = a + b x MB per op, from rows as k_sweep times them (tbps = MB / us), an error row skipped."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for op, a, b in (("gate", 3.5, 0.24), ("qkv", 5.0, 0.31)):
        for mb in (5.8, 11.5, 23.1, 46.1, 92.3):
            us = a + b * mb + float(torch.randn(1, generator=g)) * 1e-9
            rows.append({"op": op, "tile": f"{mb} MB", "us": us, "tbps": mb / us})
    rows.append({"op": "qkv", "tile": "K 8192", "error": "OutOfResources"})
    rows.append({"op": "o", "tile": "K 2048", "us": 6.0, "tbps": 1.4})  # one size: no line
    fits = scaling.line_fit(rows)
    assert [f["op"] for f in fits] == ["gate", "qkv"]
    for fit, (a, b) in zip(fits, ((3.5, 0.24), (5.0, 0.31))):
        assert abs(fit["intercept_us"] - a) < 1e-6 and abs(fit["us_per_mb"] - b) < 1e-8
        assert fit["tile"] == "fit" and abs(fit["tbps"] - 1 / b) < 1e-6


def test_packed_weight_layouts_hold_each_box_where_the_probe_kernel_reads_it():
    n, bn, bk, k = 96, 16, 32, 128
    w = torch.randn(2 * n, k)
    kb = k // bk
    blocked, paired = weight_layout.pack(w, bn, bk, "blocked"), weight_layout.pack(w, bn, bk, "paired")
    assert weight_layout.pack(w, bn, bk, "rowmajor") is w
    for t in range(2 * n // bn):
        for b in range(kb):
            box = w[t * bn:(t + 1) * bn, b * bk:(b + 1) * bk]
            assert torch.equal(blocked[(t * kb + b) * bn:(t * kb + b + 1) * bn], box)
            if t < n // bn:  # gate tile t, then up tile t, for K block b
                up = w[n + t * bn:n + (t + 1) * bn, b * bk:(b + 1) * bk]
                assert torch.equal(paired[(t * kb + b) * 2 * bn:(t * kb + b) * 2 * bn + bn], box)
                assert torch.equal(paired[(t * kb + b) * 2 * bn + bn:(t * kb + b + 1) * 2 * bn], up)


def test_the_weight_layout_table_marks_wrong_outputs():
    rows = [{"shape": "gate_up bn64", "programs": 88, "stages": 4, "layout": "rowmajor", "us": 20.0, "tbps": 2.31,
             "ok": True},
            {"shape": "gate_up bn64", "programs": 88, "stages": 4, "layout": "paired", "us": 17.5, "tbps": 2.64,
             "ok": False}]
    lines = weight_layout.markdown(rows).splitlines()
    assert lines[2] == "| gate_up bn64 | 88 | 4 | rowmajor | 20.00 | 2.31 |"
    assert lines[3] == "| gate_up bn64 | 88 | 4 | paired | 17.50 WRONG | 2.64 |"
    rows[1].update(layout="paired, x once", ok=None)
    once = "| gate_up bn64 | 88 | 4 | paired, x once | 17.50 (timing only) | 2.64 |"
    assert weight_layout.markdown(rows).splitlines()[3] == once


INTERPRETED = """
import torch
from tests.benchmark_scripts import load_benchmark
probe = load_benchmark("weight_layout_probe")
g = torch.Generator().manual_seed(11)
for n, bn, k, rows in [(256, 64, 512, 16), (96, 16, 256, 64), (128, 32, 384, 32)]:
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(2 * n, k, generator=g) / k ** 0.5
    gate, up = x.double() @ w[:n].double().T, x.double() @ w[n:].double().T
    want = gate / (1 + torch.exp(-gate)) * up
    for layout in probe.LAYOUTS:
        got = probe.launch(x, probe.pack(w, bn, probe.BK, layout), n, bn, layout, 3)
        assert probe.rel_err(got, want) < 1e-5, (n, bn, layout, probe.rel_err(got, want))
        x0 = x[:, :probe.BK].repeat(1, k // probe.BK)  # --x-once: x's first K block against every K block
        gate, up = x0.double() @ w[:n].double().T, x0.double() @ w[n:].double().T
        got = probe.launch(x, probe.pack(w, bn, probe.BK, layout), n, bn, layout, 3, x_once=True)
        assert probe.rel_err(got, gate / (1 + torch.exp(-gate)) * up) < 1e-5, (n, bn, layout, "x once")
print("ok")
"""


def test_the_probe_kernel_reads_every_layout_right_in_tritons_interpreter():
    run_interpreted(INTERPRETED)


SPLIT_INTERPRETED = """
import torch
from tests.benchmark_scripts import load_benchmark
probe = load_benchmark("splitk_pair_probe")
g = torch.Generator().manual_seed(5)
for n, bn, splits, k, rows, bk in [(64, 16, 1, 512, 64, 128), (64, 32, 2, 512, 64, 128), (128, 32, 4, 512, 16, 64),
                                  (96, 16, 2, 256, 32, 128)]:
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(2 * n, k, generator=g) / k ** 0.5
    gate, up = x.double() @ w[:n].double().T, x.double() @ w[n:].double().T
    want = gate / (1 + torch.exp(-gate)) * up
    ws = probe.workspace(n, bn, splits, "cpu")
    for _ in range(2):  # the counters are back at zero, so a second launch sums right too
        got = probe.launch(x, w, n, bn, splits, ws, bk=bk)
        assert float((got.double() - want).norm() / want.norm()) < 1e-5, (n, bn, splits, bk)
        assert not ws[1].any(), ws[1]
print("ok")
"""


def test_the_split_k_pair_probe_sums_every_split_once_in_tritons_interpreter():
    run_interpreted(SPLIT_INTERPRETED)


def test_the_split_k_pair_probe_refuses_splits_that_do_not_divide_k():
    split = load_benchmark("splitk_pair_probe")
    x, w = torch.zeros(64, 384), torch.zeros(64, 384)
    with pytest.raises(ValueError, match=r"splits=2 must divide the K blocks \(3\)"):
        split.launch(x, w, 32, 16, 2, split.workspace(32, 16, 2, "cpu"))


def test_a_scaling_mode_saves_its_rows_and_table(tmp_path, monkeypatch):
    rows = [{"op": "gate", "tile": "K 256", "us": 5.44, "tbps": 1.06}, {"op": "qkv", "tile": "K 256", "error": "x"}]
    monkeypatch.setattr(scaling, "k_sweep", lambda: rows)
    assert scaling.main(["--out", str(tmp_path), "--k-sweep"]) == rows
    assert json.loads((tmp_path / "gemm_ksweep.json").read_text()) == rows
    table = (tmp_path / "gemm_ksweep.md").read_text().splitlines()
    assert table == ["| op | tile | us | TB/s |", "|---|---|---|---|", "| gate | K 256 | 5.44 | 1.06 |"]  # no error row


def test_the_narrow_table_gives_each_launchs_bound_and_error_and_drops_failed_rows():
    rows = [{"op": "o", "tile": "N 2048: 16 programs, 1 split(s), n128/k128/s4", "us": 6.0, "tbps": 1.4,
             "tensor_bound_us": 4.34, "rel_err": 2e-3},
            {"op": "o", "tile": "N 2048: 8 programs, 1 split(s), n256/k64/s4", "error": "OutOfResources: smem"}]
    lines = scaling.mode_markdown(rows, "narrow").splitlines()
    assert lines[0] == "| op | tile | us | TB/s | tensor-core bound us | rel. error |"
    assert lines[1] == "|---|---|---|---|---|---|"
    assert lines[2:] == ["| o | N 2048: 16 programs, 1 split(s), n128/k128/s4 | 6.00 | 1.40 | 4.34 | 2.0e-03 |"]


def test_the_tiles_table_sorts_by_op_then_time():
    rows = [{"op": "qkv", "tile": "a", "us": 9.0, "tbps": 1.0}, {"op": "gate", "tile": "b", "us": 8.0, "tbps": 1.0},
            {"op": "gate", "tile": "c", "us": 7.0, "tbps": 1.0}]
    lines = scaling.mode_markdown(rows, "tiles").splitlines()
    assert [line.split(" | ")[1] for line in lines[2:]] == ["c", "b", "a"]
    assert lines[0] == "| op | tile | us | TB/s |"
