"""benchmarks/norm_chain_layers.py's stacked way over several chained layers in Triton's interpreter (where Triton is
installed; CI installs it) against the layers' math in float64: each residual formed by the next chain's producer, the
last one after the loop, every layer's q; rows below the 64-row tile too."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import load_benchmark
from tests.interpreter import run_interpreted

INTERPRETED = """
import torch
from tests.benchmark_scripts import load_benchmark
layers_mod = load_benchmark("norm_chain_layers")
EPS = layers_mod.probe.EPS
g = torch.Generator().manual_seed(5)
def rms(v):
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS)
def err(got, want):
    return float((got.double() - want).norm() / want.norm())
def rope(t, pos, inv, hd):
    ang = pos.double()[:, None, None] * inv.double()[None, None, :]
    x1, x2 = t[..., :hd // 2], t[..., hd // 2:]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)
nq, nkv, hd, hidden, inter, k_o = 2, 1, 128, 256, 128, 256
for rows, n_layers, producer in [(64, 3, (16, 128)), (7, 2, (32, 128))]:
    a, h = torch.randn(rows, k_o, generator=g), torch.randn(rows, hidden, generator=g)
    norms = {n: 1 + 0.1 * torch.randn(hidden, generator=g) for n in ("wa", "wb", "wc", "wd")}
    shapes = {"o": (hidden, k_o), "gate_up": (2 * inter, hidden), "down": (hidden, inter),
              "qkv": ((nq + 2 * nkv) * hd, hidden)}
    layers = [{n: torch.randn(*s, generator=g) / s[1] ** 0.5 for n, s in shapes.items()} for _ in range(n_layers)]
    pos = torch.randint(0, 500, (rows,), generator=g, dtype=torch.int32)
    slots = torch.randperm(80, generator=g)[:rows].to(torch.int32)
    inv = 1.0 / 10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    rope_args = {"positions": pos, "slots": slots, "inv_freq": inv, "k_plane": torch.zeros(80, nkv, hd),
                 "v_plane": torch.zeros(80, nkv, hd)}
    qs, h_end = layers_mod.stacked_layers(a, h, layers, norms, rope_args, (nq, nkv, hd), producer)
    want_h, n = h.double(), {k: v.double() for k, v in norms.items()}
    for i, w in enumerate(layers):
        w = {k: v.double() for k, v in w.items()}
        want_h = want_h + rms(a.double() @ w["o"].T) * n["wa"]
        x = rms(want_h) * n["wb"]
        gate, up = x @ w["gate_up"][:inter].T, x @ w["gate_up"][inter:].T
        want_h = want_h + rms((gate / (1 + torch.exp(-gate)) * up) @ w["down"].T) * n["wc"]
        qkv = rope((rms(want_h) * n["wd"] @ w["qkv"].T).view(rows, nq + 2 * nkv, hd), pos, inv, hd)
        assert err(qs[i], qkv[:, :nq]) < 1e-5, ("q", rows, i, err(qs[i], qkv[:, :nq]))
    assert err(rope_args["k_plane"][slots.long()], qkv[:, nq:nq + nkv]) < 1e-5, "the last layer's keys"
    assert err(h_end, want_h) < 1e-5, ("the final residual", rows, err(h_end, want_h))
print("ok")
"""


def test_stacked_layers_match_the_layers_in_float64_in_tritons_interpreter():
    run_interpreted(INTERPRETED)


def test_stages_gate_ups_stacked_boxes_do_not_fit_are_refused(capsys):
    layers_mod = load_benchmark("norm_chain_layers")
    with pytest.raises(SystemExit) as exit_info:
        layers_mod.main(["--out", "unused", "--stages", "3,4"])
    assert exit_info.value.code == 2
    assert "--stages must be a comma list of 2 and 3" in capsys.readouterr().err


def test_each_rounds_stacked_rows_are_compared_with_that_rounds_today():
    layers_mod = load_benchmark("norm_chain_layers")
    row = {"stages": 3, "q_err": 1e-3, "h_err": 1e-3, "ok": True}
    rows = [{**row, "way": "today", "stages": 0, "layer_us": 50.0}, {**row, "way": "stacked", "layer_us": 45.0},
            {**row, "way": "today", "stages": 0, "layer_us": 52.0}, {**row, "way": "stacked", "layer_us": 49.0}]
    table = layers_mod.markdown(rows)
    assert "| stacked | 3 | 45.00 | -5.00 |" in table and "| stacked | 3 | 49.00 | -3.00 |" in table
    assert "| today | table | 52.00 | +0.00 |" in table
