"""benchmarks/head_split_probe.py's CPU side: the halves of a layer's weights against the whole layer's math in float64
(q, k, v per head; o_proj and down_proj as sums over the halves; SiLU x up per column), its refusals and its table
(the timings and the bit-equality with the engine's pass need a GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.benchmark_scripts import load_benchmark

SHAPES = [(4, 4, 8, 12, 16), (8, 2, 16, 10, 32), (2, 2, 4, 6, 8)]  # heads, kv_heads, head_dim, inter, hidden


def random_layer(heads, kv_heads, d, inter, hidden, seed):
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return w((heads + 2 * kv_heads) * d, hidden), w(hidden, heads * d), w(2 * inter, hidden), w(hidden, inter)


@pytest.mark.parametrize("shape", SHAPES)
def test_the_halves_compute_the_layer(shape):
    probe = load_benchmark("head_split_probe")
    heads, kv_heads, d, inter, hidden = shape
    w_qkv, w_o, w_gu, w_d = random_layer(*shape, seed=sum(shape))
    halves = probe.split_layer(w_qkv, w_o, w_gu, w_d, heads, kv_heads, d)
    x = torch.randn(5, hidden, dtype=torch.float64)
    a = torch.randn(5, heads * d, dtype=torch.float64)
    # the whole layer, written from its description: q, k, v per head; o = a @ w_o.T; silu(gate) * up; down
    q, k, v = F.linear(x, w_qkv).split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    gate, up = F.linear(x, w_gu).chunk(2, dim=-1)
    act = F.silu(gate) * up
    hq, hkv = heads // 2, kv_heads // 2
    for j, half in enumerate(halves):
        assert all(t.is_contiguous() for t in (half.qkv, half.o, half.gate_up, half.down))
        qj, kj, vj = F.linear(x, half.qkv).split([hq * d, hkv * d, hkv * d], dim=-1)
        torch.testing.assert_close(qj, q.view(5, heads, d)[:, j * hq:(j + 1) * hq].reshape(5, -1))
        torch.testing.assert_close(kj, k.view(5, kv_heads, d)[:, j * hkv:(j + 1) * hkv].reshape(5, -1))
        torch.testing.assert_close(vj, v.view(5, kv_heads, d)[:, j * hkv:(j + 1) * hkv].reshape(5, -1))
        g_j, u_j = F.linear(x, half.gate_up).chunk(2, dim=-1)
        torch.testing.assert_close(F.silu(g_j) * u_j, act[:, j * inter // 2:(j + 1) * inter // 2])
    o = sum(F.linear(a.view(5, heads, d)[:, j * hq:(j + 1) * hq].reshape(5, -1), h.o) for j, h in enumerate(halves))
    torch.testing.assert_close(o, F.linear(a, w_o))
    down = sum(F.linear(act[:, j * inter // 2:(j + 1) * inter // 2], h.down) for j, h in enumerate(halves))
    torch.testing.assert_close(down, F.linear(act, w_d))


def test_odd_heads_or_columns_are_refused():
    probe = load_benchmark("head_split_probe")
    for shape in ((3, 3, 4, 6, 8), (4, 2, 4, 5, 8), (4, 1, 4, 6, 8)):
        heads, kv_heads, d = shape[:3]
        with pytest.raises(ValueError, match="must be even"):
            probe.split_layer(*random_layer(*shape, seed=1), heads, kv_heads, d)


def test_splits_that_miss_the_halves_boundary_are_refused():
    probe = load_benchmark("head_split_probe")
    probe.check_splits(4, 4, 5632, 128)  # Ouro-1.4B at 64 rows: down's splits of 1408 meet at 2816
    probe.check_splits(2, 2, 5632, 128)  # one split a half
    for splits_o, splits_down, inter in ((3, 4, 5632), (4, 6, 5632), (4, 4, 5632 - 256), (4, 3, 5632)):
        with pytest.raises(ValueError, match="must be even"):
            probe.check_splits(splits_o, splits_down, inter, 128)


def test_ways_are_checked():
    probe = load_benchmark("head_split_probe")
    assert probe.check_ways(["kernels", "lag:par", "full:serial"]) == ["kernels", "lag:par", "full:serial"]
    for bad in (["par"], ["lag:fast"], ["a:b:c"], []):
        with pytest.raises(ValueError, match="--ways"):
            probe.check_ways(bad)


def test_the_table_reports_each_way_against_kernels():
    probe = load_benchmark("head_split_probe")
    result = {"rows": 64, "context": 640, "device": "H100", "floor_ms": 2.0,
              "ways": {"kernels": [3.0, 3.024], "lag:lag": [2.9, 2.88]},
              "checks": {"kernels": {"equal": True}, "lag:lag": {"equal": False}}}
    lines = probe.table(result).splitlines()
    assert len(lines) == 4
    assert lines[2] == "| kernels | 3.000 / 3.024 | 1.500 | +0.00 | True |"
    assert lines[3] == "| lag:lag | 2.900 / 2.880 | 1.440 | -5.00 | False |"
